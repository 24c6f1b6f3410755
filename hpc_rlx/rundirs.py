"""`python -m hpc_rlx.rundirs OVERRIDES`: which run directory a run would use (and whether it
resumes there). The command keeps its name; the code is `hpc_rlx.config.rundirs`."""

from hpc_rlx.config.rundirs import main

if __name__ == "__main__":
    raise SystemExit(main())
