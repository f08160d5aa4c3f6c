import sys

from ssogvit.cli import main

sys.exit(main())
