"""The one forward-pass definition (`transformer`), made from a checkpoint (`load`), its quantized
layers (`quant`), its hybrid FFN of neuron sets (`sparse`), the predictors at run time
(`predictor`), and the copy of a file in the block types the CPU kernel reads (`convert`)."""
