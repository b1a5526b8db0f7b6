"""The JAX side of tierlm (jax + optax, imported only when used): the native GPT's forward in
`jax.numpy` over the PyTorch model's own parameter names (`tierlm.jax.gpt`), seed 001's `JaxAdam`
(`tierlm.jax.optim`), the strategies' losses as JAX twins (`tierlm.jax.losses`), and the backend that
trains with them behind the tier-0 protocol (`tierlm.backends.jax.JaxTrainingBackend`).

Parameters are a flat dict {PyTorch parameter name: array}, so a checkpoint is the same file for
both backends and crosses between them as it is.
"""
