"""Reading checkpoints, one module per source kind (kiln/sources.py holds the naming rules): each module's ``IO``
identifies a reference (its content digest and config.json, no weights), materializes it (the identified bytes on
local disk) and, for a moving reference, says which revision it names now. builder/resolve.py holds the table."""
