// softkv: a soft-retrieval key-value store. Include this one header for the whole public API.
#pragma once

#include "softkv/client.hpp"
#include "softkv/collection.hpp"
#include "softkv/types.hpp"
#include "softkv/database.hpp"
#include "softkv/error.hpp"
#include "softkv/simd.hpp"
#include "softkv/version.hpp"
