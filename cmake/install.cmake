# Install rules and the exported softkv::softkv and softkv::client targets for find_package(softkv).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS softkv softkv_client EXPORT softkvTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# softkv::mpi is built in the tree only (not installed yet: its exported config would need MPI's C
# language in every consumer), so its header stays out of the installed tree too.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/softkv DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} PATTERN mpi.hpp EXCLUDE)
install(FILES ${PROJECT_BINARY_DIR}/include/softkv/version.hpp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/softkv)

set(softkv_config_dir ${CMAKE_INSTALL_LIBDIR}/cmake/softkv)
install(EXPORT softkvTargets NAMESPACE softkv:: DESTINATION ${softkv_config_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/softkv-config.cmake.in
  ${PROJECT_BINARY_DIR}/softkv-config.cmake INSTALL_DESTINATION ${softkv_config_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/softkv-config-version.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/softkv-config.cmake ${PROJECT_BINARY_DIR}/softkv-config-version.cmake
  DESTINATION ${softkv_config_dir})
