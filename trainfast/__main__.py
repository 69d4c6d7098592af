import sys

from trainfast.cli import main

sys.exit(main())
