"""storage: where every output of a partition lives and how it is written so that a crash never corrupts it.

`DatasetLayout` names every path of a partition; files are written atomically; the journal tables are
append-only part files; an object-store root is a working copy synchronised around each stage; data versions
are derived from content. Imports nothing else of the core.
"""
