// Links only softkv::client: connecting where no server listens must fail with a typed io_error.
#include <cstdio>

#include <softkv/client.hpp>
#include <softkv/error.hpp>

int main() {
  try {
    softkv::Client client({"127.0.0.1", 1});  // port 1: nothing listens there
  } catch (const softkv::Error& e) {
    const bool ok = e.code() == softkv::ErrorCode::io_error;
    std::printf("softkv::client only: %s -> %s\n", e.what(), ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
  }
  std::printf("connected to port 1?\n");
  return 1;
}
