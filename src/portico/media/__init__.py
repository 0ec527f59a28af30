"""Media: the MediaStore port (base), its backends, and the MediaService that
decides who may upload, read and name which media."""
