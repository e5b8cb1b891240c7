"""Thin DVC stage drivers that are not plain ``opdkit`` commands (``python -m opdkit.stages.X``).

Each has a ``main()`` that reads only its own params section; the paths come from ``dvc.yaml``.
"""
