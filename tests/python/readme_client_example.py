import numpy as np
import softkv

with softkv.Client("127.0.0.1", 7878) as server:          # the server `make run` started
    server.create_collection("animals", 3, 2)
    server.add("animals", [[1, 0, 0], [0, 1, 0], [0.9, 0.1, 0]], [[1, 0], [0, 1], [0.5, 0.5]])
    query = np.array([1, 0.2, 0], dtype=np.float32)
    soft = server.query_soft("animals", query, temperature=0.5)
    hard = server.query_hard("animals", query)
    print(f"soft {soft.value.round(3)}, hard {hard.value} (id {hard.id})")
