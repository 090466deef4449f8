import sys

from nodeagent.agent import main

sys.exit(main())
