"""`python -m mlm_ddp.probe`: the downstream probe of one model (mlm_ddp/probe/standalone.py)."""

import sys

from mlm_ddp.probe.standalone import main

if __name__ == "__main__":
    sys.exit(main())
