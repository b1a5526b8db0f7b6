"""From a config to the parts of a run (torchtitan's `build_*` functions): the model (`model`), where a run
starts and its tokenizer (`tokenizer`), the data loaders (`loaders`), RL's tasks (`tasks`), the optimizer's
settings (`optimizer`) and the backend (`backend`); and `stage`, what a training stage declares to these
builders, the planner and the run skeleton."""
