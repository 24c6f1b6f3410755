import sys

from hpc_rlx.export.command import main

sys.exit(main())
