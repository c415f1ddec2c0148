import numpy as np
import softkv

memory = softkv.Collection(3, 2)                           # keys in R^3, values in R^2
memory.add_batch([[1, 0, 0], [0, 1, 0], [0.9, 0.1, 0]],   # ids 0, 1, 2
                 [[1, 0], [0, 1], [0.5, 0.5]])
query = np.array([1, 0.2, 0], dtype=np.float32)          # float32: read in place, no copy
soft = memory.query_soft(query, temperature=0.5, top_m=1)
hard = memory.query_hard(query)
print(f"soft {soft.value.round(3)}: {soft.top.weights[0]:.0%} of the weight on id {soft.top.ids[0]}")
print(f"hard {hard.value}: id {hard.id}")
