from composite.errors import exits_cleanly
from composite.qnn_host import main

exits_cleanly(main)()
