"""Training text of the toy tokenizer (see README.txt); a package so wheels ship it."""
