from bert_core.cli import main

raise SystemExit(main())
