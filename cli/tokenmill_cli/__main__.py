"""``python -m tokenmill_cli``: the ``tokenmill`` command where its script is not on PATH."""

from tokenmill_cli.main import main

main()
