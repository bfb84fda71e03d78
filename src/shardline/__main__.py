from shardline.cli import main

raise SystemExit(main())
