# Doctests of the package: keep `python -m tierlm` (which runs the CLI) out of collection.
collect_ignore = ["__main__.py"]
