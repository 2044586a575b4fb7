"""How a call's tokens are laid out for the stages: the chunked layout, dense or packed
(``layout``), exact sequence resets inside chunks that several sequences share
(``resets``) and their final states and gradients (``shared_states``, over the ragged
per-sequence products of ``ragged``), tiles of chunks with the state carried between them
(``tiles``), and views of the caller's own arrays for stages that read them in place
(``tokens``). Imports only ``kdax._numerics`` and ``kdax.ref`` (KDA's gate, for the states
entering shared chunks)."""
