"""The synthetic worlds the embedded models learn, generated here, never downloaded: moving shapes with their
captions (:mod:`.moving_shapes`) and their dataset folder (:mod:`.shapes_dataset`), bouncing shapes for long
videos (:mod:`.bouncing_shapes`), and scikit-learn's handwritten digits as a class-to-image folder
(:mod:`.digits`)."""
