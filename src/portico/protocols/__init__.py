"""Sans-I/O protocol cores: typed frames in, typed frames out, no sockets, no clock."""
