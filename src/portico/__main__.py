from portico.cli import main

raise SystemExit(main())
