"""`python -m harness.agent`. A package's __main__, so that the ranks (forks of the fork
server, which imported harness.agent) do not run the agent module again as __mp_main__."""
import sys

from harness.agent import main

sys.exit(main())
