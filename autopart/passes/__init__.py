"""The compiler's front: model file -> fx graph -> annotated ops -> block chain."""
