# Doctests of the package: keep `python -m tierlm` (which runs the CLI) out of collection.
import importlib.util

collect_ignore = ["__main__.py"]

if importlib.util.find_spec("deepspeed") is not None:
    # transformers imports DeepSpeed where it is installed, and DeepSpeed's first accelerator detection prints a
    # warning to stdout: let it print now, not into the output of whichever doctest first saves a model.
    from deepspeed.accelerator import get_accelerator

    get_accelerator()
