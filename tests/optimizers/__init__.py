"""The library's Kron, Shampoo and Muon: math, tiles on any mesh, state dtypes, migration."""
