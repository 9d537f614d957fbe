"""Command-line tools, each run as ``python -m tknp_megatron.tools.<name>``, or after
``pip install -e .`` as the ``tknp-*`` console script that ``setup.py`` names for it
(``tknp-bench-serving``, ``tknp-capacity-report``, ...)."""
