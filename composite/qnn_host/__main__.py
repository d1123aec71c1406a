from composite.errors import exits_cleanly
from composite.qnn_host import main

if __name__ == "__main__":
    exits_cleanly(main)()
