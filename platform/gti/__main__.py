from gti.cli import main

raise SystemExit(main())
