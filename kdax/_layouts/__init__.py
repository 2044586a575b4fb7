"""How a call's tokens are laid out for the stages: the chunked layout (``layout``), exact
resets in shared chunks (``resets``), their final and entering states (``shared_states``,
over ``ragged``'s per-sequence products), tiles (``tiles``), views of the caller's arrays
(``tokens``). docs/DESIGN.md §7."""
