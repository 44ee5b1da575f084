"""The ``kvtier`` command line. Each command lives in its own module with a
``register(subparsers)`` function; :mod:`kvtier.cli.main` lists them."""
