import sys

from hpc_rlx.report.text import main

sys.exit(main())
