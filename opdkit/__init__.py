"""opdkit: on-policy distillation (OPD) for math-reasoning language models.

Importing opdkit has no side effects. Axis suffixes used throughout (docs/design.md, "Style"):
``B`` sequences, ``T`` completion positions, ``S`` full sequence positions, ``V`` vocabulary,
``K`` top-k, ``P`` prompts, ``G`` samples per prompt.
"""

__version__ = "0.1.0"
