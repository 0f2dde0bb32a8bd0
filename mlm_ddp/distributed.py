"""`python -m mlm_ddp.distributed`: the launcher's view of this process, or `--diagnose OUTPUT_DIR`.

The body is mlm_ddp/cluster/launcher.py; this module keeps the command where users type it."""

import sys

from mlm_ddp.cluster.launcher import main

if __name__ == "__main__":
    sys.exit(main())
