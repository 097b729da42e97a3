"""How lrkv meets the machine: files, the root folder it builds in, memory, dtypes and fingerprints.

Writing files and directories atomically (:mod:`.files`), where lrkv keeps what it builds (:mod:`.paths`), the
peak resident memory of a piece of work (:mod:`.memory`), dtypes by name (:mod:`.dtypes`), content
fingerprints (:mod:`.fingerprint`) and fingerprints of the code an entry point runs
(:mod:`.code_fingerprint`).
"""
