"""Models named by their Hugging Face Hub id: the id's forms and the files it means (refs), the
model found in or downloaded into the Hub's cache (download), and the cache listed and pruned
(cache). Below the model layer: it hands the loader a path and knows nothing of architectures."""
