from tierlm.cli import main

raise SystemExit(main())
