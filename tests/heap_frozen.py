"""The last module the fork server and the rank server import (helpers.PRELOAD): collects, then
`gc.freeze()`s.

Every object the preloading left alive moves to the collector's permanent generation, so a forked
rank's full collections walk only what the rank made itself (Python's documentation advises this
before forking: walking the inherited heap writes into each object's header and copies its page).
docs/testing.md, "Start-up".
"""

import gc

gc.collect()
gc.freeze()
