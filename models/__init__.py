"""blockspec.models: how the default draft is made, beside the weights in this folder
(models/smollm2-draft/): its training (`train_draft`) on prompts from `prompts`. A command,
``python -m blockspec.models.train_draft ...``, run from a checkout: it reads and writes the
checkout's models/ and .cache/ folders."""
