from ep_harness.cli import main

raise SystemExit(main())
