"""`python -m ep_harness.launch.agent`. A package's __main__, so that the ranks (forks of the fork
server, which imported ep_harness.launch.agent) do not run the agent module again as __mp_main__."""
import sys

from ep_harness.launch.agent import main

sys.exit(main())
