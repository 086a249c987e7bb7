"""The coding toolkit: the checksummed bitstream container, varints and bit packing, the entropy coders
(constriction's range coder behind one stream API) and exact coding of 16-bit floats."""
