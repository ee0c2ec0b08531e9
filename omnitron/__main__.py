import sys

from omnitron.cli import main

sys.exit(main())
