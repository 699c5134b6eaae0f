import sys

from monet_like.cli import main

sys.exit(main())
