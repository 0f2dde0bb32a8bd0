"""`python -m mlm_ddp.report RUN_DIR [RUN_DIR ...]`: the HTML report of one run or several.

The body is mlm_ddp/run/report.py; this module keeps the command where users type it."""

import sys

from mlm_ddp.run.report import main

if __name__ == "__main__":
    sys.exit(main())
