"""storage: where every output of a partition lives and how it is written so that a crash never corrupts it.

`DatasetLayout` names every path of a partition; files are written atomically; the journal tables are
append-only part files; an object-store root is a working copy synchronised around each stage; data versions
are derived from content; `proxy` decides, for every outbound HTTP request of the platform, the HTTP proxy it
goes through (here, in the lowest stage, so that every layer can ask it). Imports nothing else of the core.
"""
