from opdkit.cli import main

raise SystemExit(main())
