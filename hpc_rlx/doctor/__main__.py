import sys

from hpc_rlx.doctor.check import main

code = main()
sys.stdout.flush()
sys.exit(code)
