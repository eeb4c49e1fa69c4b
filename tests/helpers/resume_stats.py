"""Every rank runs the resume's choice (``reader.find_resume_point``, sizes only) with each ``os.stat`` counted.

Usage: resume_stats.py CKPT_ROOT OUT. Writes ``OUT.rank<R>``: ``{"found": <chosen name or null>,
"stats": [paths stat'd under CKPT_ROOT], "warnings": [what it logged on resilience.checkpoint]}``.
"""

import json
import logging
import os
import sys
from pathlib import Path

import ranks  # this folder's shared rank start
from resilience.checkpoint.reader import find_resume_point
from resilience.distributed import DistContext

root, out = Path(sys.argv[1]), sys.argv[2]
world, rank = ranks.join()
ctx = DistContext.from_env()
seen, real_stat, warnings = [], os.stat, []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda rec: warnings.append(rec.getMessage())
logging.getLogger("resilience.checkpoint").addHandler(handler)


def counting_stat(path, *args, **kwargs):
    seen.append(os.fspath(path))
    return real_stat(path, *args, **kwargs)


os.stat = counting_stat
try:
    found, _ = find_resume_point(ctx, root, None, checksums=False)
finally:
    os.stat = real_stat
under = [p for p in seen if p.startswith(f"{root}{os.sep}")]
Path(f"{out}.rank{rank}").write_text(json.dumps({"found": found.name if found else None, "stats": under, "warnings": warnings}))
ctx.close()
