"""Code several processes use (one place, so no process package imports another's
internals): incremental detokenization and stop strings (the detokenizer emits text, the
scheduler stops on it), model facts read from its files (front and worker), llguidance's
view of a tokenizer (front and worker), a one-time background build."""
