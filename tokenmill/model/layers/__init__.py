"""Building blocks of the decoder: norm, rotary embedding, paged attention."""
