import os

from tierlm.commands.cli import main

if "TORCHELASTIC_ERROR_FILE" in os.environ:  # under torchrun: record a crash so its summary names the rank and error
    from torch.distributed.elastic.multiprocessing.errors import record

    main = record(main)

raise SystemExit(main())
